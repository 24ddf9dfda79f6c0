// The web UI's only script: live refresh of the parts of a page marked data-live, confirmation
// of actions, and the tail of a running task's log. Text from the server is only ever put in
// the page as server-escaped HTML or as text nodes, never as markup built here.
"use strict";

(function () {
  const body = document.body;
  const refreshMs = Number(body.dataset.refreshMs || 2000);

  // -- live refresh: fetch this page again, swap in the new contents of each data-live part --
  // Returns whether the server answered well (false: the next round waits longer).
  let stopped = false;
  async function refresh() {
    if (stopped || document.visibilityState !== "visible") return true;
    const parts = document.querySelectorAll("[data-live][id]");
    if (parts.length === 0) return true;
    let response;
    try {
      response = await fetch(window.location.href, {
        credentials: "same-origin",
        headers: { "X-Deferral-Live": "1" },
      });
    } catch (error) {
      body.classList.add("offline");
      return false;
    }
    if (response.redirected || !response.ok) {
      body.classList.add("offline");
      if (response.redirected) stopped = true; // logged out: the next click says so
      return false;
    }
    body.classList.remove("offline");
    const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
    for (const part of parts) {
      const replacement = fresh.getElementById(part.id);
      if (!replacement) continue;
      // A part with a key (a log: its try, and whether it is over) is kept, and grows by its
      // own tail, until its key changes.
      const key = part.dataset.liveKey;
      if (key !== undefined) {
        if (key !== replacement.dataset.liveKey) {
          part.innerHTML = replacement.innerHTML;
          part.dataset.liveKey = replacement.dataset.liveKey;
        }
      } else if (part.innerHTML !== replacement.innerHTML) {
        part.innerHTML = replacement.innerHTML;
      }
    }
    showFit();
    return true;
  }

  // One round at a time: the next starts only after this one's answer, and later the slower
  // the server answered (four times its answer time) or after a failure (doubling, up to a
  // minute): an open tab never piles requests on a busy server.
  const MAX_DELAY_MS = 60000;
  function every(round) {
    let delay = refreshMs;
    async function next() {
      const started = performance.now();
      let ok;
      try {
        ok = await round();
      } catch (error) {
        ok = false;
      }
      const took = performance.now() - started;
      delay = ok
        ? Math.min(MAX_DELAY_MS, Math.max(refreshMs, 4 * took))
        : Math.min(MAX_DELAY_MS, 2 * delay);
      if (!stopped) window.setTimeout(next, delay);
    }
    window.setTimeout(next, refreshMs);
  }
  every(refresh);

  // -- a big graph: scrolled in its frame, or scaled to fit it (kept across live refreshes) ---
  function showFit() {
    const button = document.getElementById("graph-fit");
    if (!button) return;
    const fit = body.classList.contains("graph-fit");
    button.dataset.fit = String(fit);
    button.textContent = fit ? "Actual size" : "Fit to the page";
  }
  document.addEventListener("click", function (event) {
    if (!event.target.closest("#graph-fit")) return;
    body.classList.toggle("graph-fit");
    showFit();
  });

  // -- actions ask first ----------------------------------------------------------------------
  document.addEventListener("submit", function (event) {
    const form = event.target;
    const question = form.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });

  // -- a log's tail ---------------------------------------------------------------------------
  function appendLines(list, lines) {
    const empty = document.getElementById("log-empty");
    if (empty && lines.length) empty.remove();
    for (const line of lines) {
      const item = document.createElement("li");
      item.dataset.id = String(line.id);
      const at = document.createElement("span");
      at.className = "log-at";
      at.textContent = line.at.replace("T", " ").slice(0, 23);
      const source = document.createElement("span");
      source.className = "log-source";
      source.textContent = line.source;
      const text = document.createElement("span");
      text.className = "log-text";
      text.textContent = line.text;
      item.append(at, " ", source, " ", text);
      list.appendChild(item);
    }
  }

  async function tail(list) {
    const last = list.lastElementChild;
    const after = last ? last.dataset.id : list.dataset.afterId || "0";
    const url = new URL(list.dataset.logUrl, window.location.origin);
    url.searchParams.set("after_id", after);
    try {
      const response = await fetch(url, { credentials: "same-origin" });
      if (!response.ok) return false;
      const answer = await response.json();
      appendLines(list, answer.lines);
      if (answer.finished) list.removeAttribute("data-tail");
      return true;
    } catch (error) {
      return false; // the next round tries again, later
    }
  }
  every(async function () {
    if (document.visibilityState !== "visible") return true;
    let ok = true;
    for (const list of document.querySelectorAll("ol[data-log-url][data-tail]")) {
      ok = (await tail(list)) && ok;
    }
    return ok;
  });
})();
