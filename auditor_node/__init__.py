"""The auditor node (SPEC §5.1): replays a trainer's job on its own hardware profile, signs its
own commitment, and on disagreement records a challenge naming the first divergent step.

Layers, bottom up: `leafcache` (the trainer's verified leaves, kept across the auditor's own
crashes), `states` (the trainer's checkpoints and logs, as an audit interval's worker process
fetches them), `challenge` (the SPEC §5.1 challenge as canonical bytes), `audit` (`run_audit`,
one audit in-process: sequential, in worker processes, or sampled), `runner` (a queue of audits
on one thread), `service` (the gRPC Auditor service), `server` (Claims + Auditor + health on
one port) and `cli` (`ovt-auditor`).
"""
