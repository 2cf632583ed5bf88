"""RayExecutor: the TP group as Ray actors (one ``RayWorker`` per rank, one bundle per rank).

Start-up: place the ranks (``placement.py``: a new placement group, or the current Serve replica's),
create the actors, ask rank 0 for ``node_ip_and_free_port`` and initialise every rank at once with
``tcp://ip:port`` (torch.distributed: gloo on CPU, NCCL on CUDA), take the minimum of the ranks'
``available_kv_blocks`` and initialise every cache with it.

Each step encodes the plan once (msgpack), sends the same bytes to every rank and decodes the
StepResult of rank 0 (the other ranks answer None; their replies are still awaited so that an error
on any rank surfaces in that step). Three transports, same semantics:

- ``"compiled"``: a Ray compiled graph ``InputNode -> each actor's execute_bytes -> MultiOutputNode``
  compiled once; a step is ``graph.execute(data)`` over shared-memory channels.
- ``"actor"``: plain ``actor.execute_bytes.remote(data)`` calls.
- ``"socket"``: a TCP connection per rank beside Ray (``workers/step_channel.py``): each rank answers
  steps from one long actor call that blocks on its socket, the engine blocks on the replies; Ray still
  creates, pings and kills the actors. A closed connection or a worker error reply is handled as the
  actor transport's dead actor or task error is; ``num_sequences`` goes over the channel too.

``"auto"`` (the default) is ``"socket"`` when every rank's node is the engine's own (the connection
stays on the machine; a port between nodes may be firewalled) and ``"actor"`` otherwise, decided again
at each (re)start. The compiled graph is never the default: its ranks poll their channels and keep a
core busy even while the engine is idle (a TP worker at full CPU under an idle ``pagedray serve``), and
its driver polls too.
``benchmarks/overhead.py`` measures actor calls against the compiled graph, benchmarks.serving's
``-sock`` systems the socket transport (docs/benchmarks.md).

Every wait is bounded (a step's by ``config.step_limit_s(tokens in the step)``) so a stalled rank fails the
step instead of hanging.
``shutdown`` tears the compiled graph down, kills the actors and removes the placement group if this
executor created it.

Rank failure: ``is_rank_failure(exc)`` tells the engine whether a failed step is curable by a new TP
group (dead actor, broken channel, timed-out wait; not an exception raised by worker code, which would
recur), and ``rebuild()`` replaces the whole group (stop as in shutdown, then start afresh: new
placement group when this executor owns it, else the same Serve bundles; new actors, new process group,
new empty KV cache). While rebuilding, ``check_health`` raises EngineDeadError (health says 503).
"""

from __future__ import annotations

import logging

import ray
from pagedray.workers import step_channel
from pagedray.workers.contract.config import RAY_TRANSPORTS, EngineConfig
from pagedray.workers.contract.wire import StepPlan, StepResult, decode_result, encode_plan

from .outputs import EngineDeadError
from .placement import Placement, place_ranks

log = logging.getLogger(__name__)

TRANSPORTS = RAY_TRANSPORTS
HEALTH_PING_TIMEOUT_S = 2.0   # an unanswered health ping means busy, not dead (a dead actor fails fast)
DEAD_PING_TIMEOUT_S = 2.0
START_TIMEOUT_S = 300.0   # bound on each start-up wait (actor creation + weight loading + KV init)
CHANNEL_BUFFER_BYTES = 8 * 1024 * 1024   # initial shared-memory channel size of the compiled graph


class RankFailureError(RuntimeError):
    """A step failed because a TP rank died, lost its channel or stopped answering (curable by rebuild)."""


class StepWorkerError(RuntimeError):
    """A rank's worker code raised during a step (socket transport: the error text it sent back)."""


def _wants_gpu(config: EngineConfig) -> bool:
    if config.model.device == "cuda":
        return True
    if config.model.device == "cpu":
        return False
    return bool(ray.cluster_resources().get("GPU", 0))


class RayExecutor:
    def __init__(self, config: EngineConfig, transport: str | None = None) -> None:
        transport = config.parallel.ray_transport if transport is None else transport
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {TRANSPORTS}, got {transport!r}")
        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        self.config = config
        self._requested_transport = transport
        self.transport = transport   # "auto" resolved at start (_start)
        self.rank_pids: list[int] = []
        self.tp_size = config.parallel.tensor_parallel_size
        self._timeout = config.step_timeout_s
        self._graph = None
        self._channels = []   # socket transport: one connected step channel per rank
        self._serving = []    # socket transport: the ranks' serve_step_channel calls (end with the channels)
        self._closed = False
        self._rebuilding = False
        self._steps_in_flight = 0   # execute() calls running now (read by check_health on another thread)
        self.num_rebuilds = 0
        self.actors = []
        self.placement: Placement | None = None
        self._start()

    def _start(self) -> None:
        """Places the ranks, creates and initialises the actors, compiles the graph (all or nothing)."""
        from pagedray.workers.ray_worker import RayWorker

        self.placement = place_ranks(self.tp_size, _wants_gpu(self.config), self.config.parallel.placement_strategy)
        try:
            self.actors = [RayWorker.options(**self.placement.actor_options(rank)).remote(self.config, rank)
                           for rank in range(self.tp_size)]
            self._init_workers()
            self.transport = self._resolve_transport()
            if self.transport == "compiled":
                self._graph = self._compile()
            elif self.transport == "socket":
                self._channels = self._open_channels()
            log.info("TP group of %d rank(s) ready: transport %s, rank processes %s", self.tp_size, self.transport,
                     self.rank_pids)
        except BaseException:
            self._stop()
            raise

    def _stop(self, kill_first: bool = False) -> None:
        """Tears the compiled graph down, kills the actors, removes the placement group if created here.

        ``kill_first`` (after a rank failure): kill the actors before the teardown, since a surviving rank
        may be blocked in a collective with the dead one and the teardown would wait for it."""
        if kill_first:
            self._kill_actors()
        for conn in self._channels:
            conn.close()
        self._channels, self._serving = [], []
        if self._graph is not None:
            try:
                self._graph.teardown()
            except Exception:  # a dead rank makes teardown complain; the actors are killed anyway
                pass
            self._graph = None
        self._kill_actors()
        if self.placement is not None:
            self.placement.remove()

    def _kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    @staticmethod
    def is_rank_failure(exc: BaseException) -> bool:
        """True when a failed step is curable by a new TP group (``execute`` raised RankFailureError)."""
        return isinstance(exc, RankFailureError)

    def _classify_failure(self, exc: Exception) -> Exception:
        """A dead actor, a lost channel or a timed-out wait is a rank failure; so is any error (e.g. a
        collective that lost its peer) while some rank's actor is dead. Any other exception is raised by
        worker code and would recur in a new group: it is returned unchanged."""
        errors = ray.exceptions
        direct = (isinstance(exc, (errors.RayActorError, errors.RayChannelError, TimeoutError, OSError))
                  and not isinstance(exc, errors.RayTaskError))
        dead = self._dead_ranks()
        if direct or dead:
            return RankFailureError(f"TP rank failure (dead ranks: {dead}): {type(exc).__name__}: {exc}")
        return exc

    def _dead_ranks(self) -> list[int]:
        """Ranks whose actor is dead (a short ping; a busy rank that does not answer counts as alive;
        socket transport: ranks whose serve_step_channel call ended)."""
        if self._serving:
            ready, _ = ray.wait(list(self._serving), num_returns=len(self._serving), timeout=DEAD_PING_TIMEOUT_S)
            return [rank for rank, ref in enumerate(self._serving) if ref in ready]
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DEAD_PING_TIMEOUT_S)
        dead = []
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    dead.append(rank)
                except Exception:  # an answer of any other kind means the process is alive
                    pass
        return dead

    def rebuild(self) -> None:
        """Replaces the TP group: old graph, actors and (own) placement group go; new ones come with a fresh
        KV cache. Raises if the new group cannot start or holds fewer KV blocks than the old one."""
        if self._closed:
            raise EngineDeadError("the Ray executor has been shut down")
        old_blocks = self.num_blocks
        self._rebuilding = True
        try:
            self._stop(kill_first=True)
            self._start()
        finally:
            self._rebuilding = False
        self.num_rebuilds += 1
        if self.num_blocks < old_blocks:
            raise EngineDeadError(f"the rebuilt TP group holds {self.num_blocks} KV blocks, fewer than {old_blocks}")

    def _init_workers(self) -> None:
        if self.tp_size > 1:
            ip, port = ray.get(self.actors[0].node_ip_and_free_port.remote(), timeout=START_TIMEOUT_S)
            ray.get([a.init_worker.remote(f"tcp://{ip}:{port}") for a in self.actors], timeout=START_TIMEOUT_S)
        dtypes = ray.get([a.dtype_name.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        if len(set(dtypes)) > 1:
            raise ValueError(f"dtype: the ranks resolved {self.config.model.dtype!r} differently ({dtypes}, in "
                             "rank order; their CPUs differ): set dtype to one of them")
        self.dtype = dtypes[0]
        self.num_blocks = min(ray.get([a.available_kv_blocks.remote() for a in self.actors], timeout=START_TIMEOUT_S))
        self.num_tier_slots = min(ray.get([a.kv_tier_slots.remote() for a in self.actors], timeout=START_TIMEOUT_S))
        ray.get([a.init_kv_cache.remote(self.num_blocks) for a in self.actors], timeout=START_TIMEOUT_S)
        self.rank_pids = ray.get([a.process_id.remote() for a in self.actors], timeout=START_TIMEOUT_S)

    def _resolve_transport(self) -> str:
        if self._requested_transport != "auto":
            return self._requested_transport
        here = ray.util.get_node_ip_address()
        nodes = [ip for ip, _ in ray.get([a.node_ip_and_free_port.remote() for a in self.actors],
                                          timeout=START_TIMEOUT_S)]
        return "socket" if all(ip == here for ip in nodes) else "actor"

    def _open_channels(self) -> list:
        addresses = ray.get([a.open_step_channel.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        self._serving = [a.serve_step_channel.remote() for a in self.actors]
        return [step_channel.connect(host, port, secret, START_TIMEOUT_S) for host, port, secret in addresses]

    def _read_reply(self, rank: int, conn, timeout: float) -> bytes | None:
        conn.settimeout(timeout)
        message = step_channel.read_message(conn)
        if message is None:
            raise ConnectionError(f"TP rank {rank} closed its step channel")
        status, payload = message[:1], message[1:]
        if status == step_channel.ERROR:
            raise StepWorkerError(f"TP rank {rank}: {payload.decode('utf-8', 'replace')}")
        return payload if status == step_channel.OK else None

    def _compile(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan_bytes:
            graph = MultiOutputNode([a.execute_bytes.bind(plan_bytes) for a in self.actors])
        # Ray's default 10 s submit/get timeouts would fail long prefill steps on a slow CPU: every wait is
        # bounded by step_timeout_s instead
        return graph.experimental_compile(_submit_timeout=self._timeout, _buffer_size_bytes=CHANNEL_BUFFER_BYTES)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.wait(self.submit(plan))

    def submit(self, plan: StepPlan) -> tuple[list, float]:
        """Sends the plan to every rank (an actor runs its calls in order); the handle for ``wait``."""
        if self._closed:
            raise EngineDeadError("the Ray executor has been shut down")
        data = encode_plan(plan)
        timeout = self.config.step_limit_s(plan.num_scheduled_tokens)
        try:
            if self._graph is not None:
                refs = self._graph.execute(data)
            elif self._channels:
                for conn in self._channels:
                    step_channel.write_message(conn, data)
                refs = None
            else:
                refs = [a.execute_bytes.remote(data) for a in self.actors]
        except Exception as exc:
            self._raise_classified(exc)
        self._steps_in_flight += 1
        return refs, timeout

    def wait(self, handle: tuple[list, float]) -> StepResult:
        refs, timeout = handle
        try:
            if self._graph is not None:
                replies = [ref.get(timeout=timeout) for ref in refs]
            elif refs is None:
                replies = [self._read_reply(rank, conn, timeout) for rank, conn in enumerate(self._channels)]
            else:
                replies = ray.get(refs, timeout=timeout)
        except Exception as exc:
            self._raise_classified(exc)
        finally:
            self._steps_in_flight -= 1
        if replies[0] is None:
            raise RuntimeError("rank 0 returned no StepResult")
        return decode_result(replies[0])

    def _raise_classified(self, exc: Exception):
        """Re-raises a failed step's exception, as RankFailureError when a new TP group can cure it."""
        failure = self._classify_failure(exc)
        if failure is exc:
            raise exc
        raise failure from exc

    def num_sequences(self) -> list[int]:
        """Mirrored sequences per rank (leak checks)."""
        if self._channels:
            if self._steps_in_flight:
                raise RuntimeError("num_sequences: a step is in flight (its reply comes first on the channel)")
            counts = []
            for rank, conn in enumerate(self._channels):
                step_channel.write_message(conn, step_channel.COUNT)
                counts.append(step_channel.COUNT_FORMAT.unpack(self._read_reply(rank, conn, START_TIMEOUT_S))[0])
            return counts
        return ray.get([a.num_sequences.remote() for a in self.actors], timeout=START_TIMEOUT_S)

    def check_health(self) -> None:
        """EngineDeadError when a rank's actor is dead.

        While a step is in flight the ranks are not pinged: the ping would queue behind the step (an
        actor runs one call at a time), and a rank that dies mid-step fails that step, which the engine
        handles. Otherwise each rank is pinged; one that does not answer within HEALTH_PING_TIMEOUT_S
        (a step started meanwhile) counts as busy, not dead: stalls are the step watchdog's business.
        Socket transport: a rank's main thread is always in its ``serve_step_channel`` call, so instead
        of a ping that call is looked at: one that has ended (the actor died, or its loop stopped) is a
        dead rank, at any time."""
        if self._closed:
            raise EngineDeadError("the Ray executor has been shut down")
        actors = list(self.actors)
        if self._rebuilding or len(actors) != self.tp_size:
            raise EngineDeadError("the TP group is being rebuilt after a rank failure")
        if self._serving:
            self._raise_if_a_loop_ended(list(self._serving))
            return
        if self._steps_in_flight:
            return
        refs = [a.ping.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HEALTH_PING_TIMEOUT_S)
        for rank, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise EngineDeadError(f"TP rank {rank} is dead: {exc}") from exc

    @staticmethod
    def _raise_if_a_loop_ended(serving: list) -> None:
        """EngineDeadError naming the first rank whose serve_step_channel call has ended (no waiting)."""
        ready, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
        for rank, ref in enumerate(serving):
            if ref in ready:
                try:
                    ray.get(ref)
                    reason = "its step channel closed"
                except Exception as exc:  # RayActorError for a dead actor; anything else ended the loop too
                    reason = f"{type(exc).__name__}: {exc}"
                raise EngineDeadError(f"TP rank {rank} is dead: {reason}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop()
