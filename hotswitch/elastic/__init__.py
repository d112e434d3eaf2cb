"""Elastic jobs: the device set changes while training runs (scale-out/in, redeployment, failure).

`job` (ElasticJob: moves the job state by the switch planner, or restores it from a checkpoint and
replays), `membership` (the agent that spawns workers, sees them die and publishes generations;
in-process regrouping), `checkpoint` (asynchronous DCP checkpoints with verified manifests).
"""
from hotswitch.elastic.job import ElasticJob, Event, Reconfiguration, configs_for
from hotswitch.elastic.membership import ElasticError, Rendezvous, register_rendezvous_store, run_elastic

__all__ = ["ElasticError", "ElasticJob", "Event", "Reconfiguration", "Rendezvous", "configs_for",
           "register_rendezvous_store", "run_elastic"]
