"""The store: what the database keeps and every change to it. The tables (``tables``), the engine
(``db``, ``metastore``), the schema's migrations and partitions, every task-state transition
(``transitions``), and the records beside them: XComs, task logs, pools, assets' events, approvals,
callback tokens, liveness rows, retention. The authoring SDK reaches it through ``seam`` only."""
