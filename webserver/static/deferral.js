// The web UI's only script: live refresh of the parts of a page marked data-live, confirmation
// of actions, and the tail of a running task's log. Text from the server is only ever put in
// the page as server-escaped HTML or as text nodes, never as markup built here.
"use strict";

(function () {
  const body = document.body;
  const refreshMs = Number(body.dataset.refreshMs || 2000);

  // -- live refresh: fetch this page again, swap in the new contents of each data-live part --
  let stopped = false;
  async function refresh() {
    if (stopped || document.visibilityState !== "visible") return;
    const parts = document.querySelectorAll("[data-live][id]");
    if (parts.length === 0) return;
    let response;
    try {
      response = await fetch(window.location.href, {
        credentials: "same-origin",
        headers: { "X-Deferral-Live": "1" },
      });
    } catch (error) {
      body.classList.add("offline");
      return;
    }
    if (response.redirected || !response.ok) {
      body.classList.add("offline");
      if (response.redirected) stopped = true; // logged out: the next click says so
      return;
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
  }
  window.setInterval(refresh, refreshMs);

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
      if (!response.ok) return;
      const answer = await response.json();
      appendLines(list, answer.lines);
      if (answer.finished) list.removeAttribute("data-tail");
    } catch (error) {
      /* the next round tries again */
    }
  }
  window.setInterval(function () {
    if (document.visibilityState !== "visible") return;
    for (const list of document.querySelectorAll("ol[data-log-url][data-tail]")) tail(list);
  }, refreshMs);
})();
