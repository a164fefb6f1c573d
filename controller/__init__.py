"""tidal-controller: the per-cluster daemon (job registry, policy, epochs, health, Slurm
poller, gRPC servers), and the `tidal` CLI."""
