"""``trainq up``: the whole system on one machine (``up``), its child processes
(``children``) and the embedded Redis and ports it picks (``embedded``)."""
