"""The daemon: serve loop, peers, steps, coverage, trainer and engine handling, worker."""
