"""The planner's subcommands, registered on `pdserve`'s parser: profile, simulate, plan, planner."""

from __future__ import annotations

import argparse


def add_planner_commands(sub: argparse._SubParsersAction) -> None:
    from services.planner.kube import add_planner_args, cmd_planner
    from services.planner.plan import add_plan_args, cmd_plan
    from services.planner.profile import add_profile_args, cmd_profile
    from services.planner.simulate import add_simulate_args, cmd_simulate

    profile = sub.add_parser("profile", help="measure prefill, decode and KV transfer times on this machine; "
                                             "write the simulator's profile file")
    add_profile_args(profile)
    profile.set_defaults(func=cmd_profile)
    simulate = sub.add_parser("simulate", help="simulate pdserve on a workload or trace (virtual time); "
                                               "report what `pdserve bench` would")
    add_simulate_args(simulate)
    simulate.set_defaults(func=cmd_simulate)
    plan = sub.add_parser("plan", help="search prefill:decode counts (and mode, chunk budget) by simulation for "
                                       "the cheapest configuration meeting TTFT / ITL p90 SLOs within a budget")
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    planner = sub.add_parser("planner", help="the live planner on Kubernetes: scale the prefill and decode "
                                             "Deployments from the gateways' metrics (as `up --autoscale` does locally)")
    add_planner_args(planner)
    planner.set_defaults(func=cmd_planner)
