"""The trainer daemon (`ovt-trainer`): a job queue that trains one job at a time into its
`JobStore`s while serving the Claims and Trainer gRPC services (SPEC §4, issue 4).

Layers: `runner` (the queue and its worker thread), `service` (the Trainer gRPC servicer, the
edge where errors become status codes), `server` (wiring: stores, runner, servicers, health,
TLS), `cli` (`ovt-trainer serve | submit | status`).
"""
