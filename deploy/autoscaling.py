"""``pagedray.deploy.autoscaling:kv_pressure_policy``: the policy path that Serve YAML files name; the
policy lives in ``routing/autoscaling.py``."""

from .routing.autoscaling import kv_pressure_policy

__all__ = ["kv_pressure_policy"]
