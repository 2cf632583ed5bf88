"""The CacheAwareRouters of this process, by (app, deployment), weakly held (see router.py: the ingress
reads every engine replica's summary from the router of its own handle).

A module of its own because Serve pickles the router class with its globals; a module is pickled by
name, a WeakValueDictionary not at all.
"""

from __future__ import annotations

import weakref

_ROUTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(app_name: str, deployment_name: str, router: object) -> None:
    _ROUTERS[(app_name, deployment_name)] = router


def unregister(app_name: str, deployment_name: str) -> None:
    _ROUTERS.pop((app_name, deployment_name), None)


def lookup(app_name: str, deployment_name: str) -> object | None:
    return _ROUTERS.get((app_name, deployment_name))
