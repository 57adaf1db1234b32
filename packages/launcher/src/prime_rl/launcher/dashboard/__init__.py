"""`dashboard PATH`: every run under a folder, side by side, live in the browser.

Modules: `discovery` (find run dirs), `metrics_tail` (incremental metrics.jsonl reader),
`status` (running / finished / failed / stale rule), `registry` (all runs + the polled JSON),
`server` (HTTP server and CLI). The page (`templates/`, `static/`) plots with uPlot, vendored in
`static/` with its MIT license, so nothing is fetched from the network at run time.
"""
