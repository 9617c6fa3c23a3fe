"""Sizing the pools: `pdserve profile` (measure), `pdserve plan` (search by simulation), and the
live autoscaler behind `pdserve up --autoscale`. The simulator itself is `shared/sim/`."""
