"""tidal-controller: the per-cluster daemon (job registry, policy, generations, health, Slurm
poller, gRPC servers), and the `tidal` CLI."""
