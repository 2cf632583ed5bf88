"""How ``pagedray serve`` stops: on Ctrl-C or SIGTERM alike, the app is removed and a private Ray shut down.

Decisions: docs/design/deploy.md, ``pagedray.deploy.cli.shutdown``.
"""

from __future__ import annotations

import signal
import threading
import time


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both end the blocking wait (also when started in the background, where a
    shell leaves SIGINT ignored), so the app is removed and a Ray started here is shut down."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"   # Serve's replica actors: "SERVE_REPLICA::<app>#<deployment>#<id>"
DRAIN_MARGIN_S = 5.0   # past graceful_shutdown_s: an ingress ends a stream whose engine Serve killed (SSE error)
# the drain (``start_drain``) aborts what is left this long before Serve force-kills a replica holding the engine
DRAIN_LEAD_S = 1.0
CALL_TIMEOUT_S = 5.0   # a call to Serve's controller (a handle to the app)


def within(call, timeout_s: float):
    """``call()``'s result, or TimeoutError when it has not returned within ``timeout_s`` (it goes on in a daemon
    thread, which cannot hold up the exit). Its exception is raised here; so is a signal's KeyboardInterrupt
    during the wait. For Ray's calls to its GCS, which wait for ever once the GCS is gone (``ray.shutdown``
    itself still ends: about 20 s on a dead GCS, measured here)."""
    outcome: list = []

    def run():
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append((False, exc))

    worker = threading.Thread(target=run, daemon=True, name="pagedray-shutdown-call")
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def requests_in_flight(app_name: str, timeout_s: float = 5.0) -> int | None:
    """Requests the app's replicas hold now: Serve's own count per replica (``get_num_ongoing_requests``,
    what a replica's graceful shutdown waits on; HTTP requests of the ingress included). None when that
    cannot be told (no replica found, Ray or a replica not answering within ``timeout_s``): then nothing is
    assumed."""
    import ray
    from ray.util import list_named_actors

    prefix = f"{REPLICA_ACTOR_PREFIX}{app_name}#"

    def count() -> int | None:
        actors = [ray.get_actor(a["name"], namespace=a["namespace"])
                  for a in list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        counts = ray.get([actor.get_num_ongoing_requests.remote() for actor in actors], timeout=timeout_s)
        return sum(counts) if actors else None

    try:
        return within(count, timeout_s)
    except Exception:  # noqa: BLE001 - any failure to ask means "unknown", never "idle"
        return None


def start_drain(name: str, timeout_s: float) -> bool:
    """Ask the app's ingress replica (the one the call reaches: with one replica, the whole app; with an engine
    deployment, one engine replica) to drain: new requests get 503, those in flight ``timeout_s`` to finish,
    then they end with finish_reason "abort" (their last chunk and ``[DONE]``) instead of being cut when
    Serve force-kills the replica. Whether the call was sent (if not, Serve's delete alone stops the app, as
    before); its response need not be kept (Serve cancels a call only when asked to)."""
    from ray import serve

    try:
        within(lambda: serve.get_app_handle(name).drain.remote(timeout_s), CALL_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the drain is a courtesy to the streams; the delete still follows
        return False
    return True


def drain_private(name: str, grace_s: float, poll_s: float = 0.2) -> None:
    """Let the requests in flight on a private Ray finish, for ``grace_s`` (``graceful_shutdown_s``) plus
    ``DRAIN_MARGIN_S`` at most, before the caller tears the Ray down.

    Decisions: with nothing in flight (``requests_in_flight`` is 0) it returns at once: ``ray.shutdown``
    ends Serve's controller, proxy and every replica and TP worker with it, while ``serve.delete`` would
    first wait out each replica's shutdown loop (seconds, doing nothing). With requests in flight, Serve is
    told to delete the app (it stops routing to it and each replica drains) and the count is polled here,
    so the teardown follows the last request instead of Serve's loops. Before the delete, the app is asked
    to drain (``start_drain``) with ``DRAIN_LEAD_S`` less: Serve force-kills a replica holding the engine
    ``grace_s`` after the delete, which cut each stream still running (a closed connection); drained, those
    end with their final chunk first (and an engine deployment's other replicas' streams with an SSE error
    event: the ingress does not fail them over while the app is deleted, ``failover.py``). When the count
    cannot be had, the blocking ``serve.delete`` is Serve's own wait, nothing is assumed, within the same
    time: a Ray whose GCS has died answers neither (each call would wait for ever), and the caller's
    ``ray.shutdown`` follows."""
    from ray import serve

    in_flight = requests_in_flight(name)
    if in_flight == 0:
        print("nothing in flight: stopping Ray", flush=True)
        return
    print(f"waiting up to {grace_s:g} s for the requests in flight (Ctrl-C again: stop now) ...", flush=True)
    if in_flight is None:
        try:
            within(lambda: serve.delete(name), grace_s + DRAIN_MARGIN_S)
        except TimeoutError:
            print(f"Serve did not finish deleting {name!r} within {grace_s + DRAIN_MARGIN_S:g} s: stopping Ray",
                  flush=True)
        return
    start_drain(name, max(0.0, grace_s - DRAIN_LEAD_S))
    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + grace_s + DRAIN_MARGIN_S
    while time.monotonic() < deadline and requests_in_flight(name):   # 0, or no replica left: done
        time.sleep(poll_s)


def stop_serving(name: str, private: bool, serve_started: bool, grace_s: float) -> None:
    """Remove the app and stop a private Ray (``drain_private`` first). A second Ctrl-C or SIGTERM cuts the
    wait for requests in flight short; the teardown itself ignores further signals, so that no Ray process
    is left behind. A joined cluster (``--address``) only gets the app deleted (Serve's own drain)."""
    import ray
    from ray import serve

    try:
        if serve_started and private:
            drain_private(name, grace_s)
        elif serve_started:
            serve.delete(name)
    except KeyboardInterrupt:
        print("stopping now (second signal): requests still in flight are cut", flush=True)
    finally:
        if private:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            ray.shutdown()
