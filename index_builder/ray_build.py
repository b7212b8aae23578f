"""`build --ray`: the passages of each chunk encoded by a pool of Ray actors, one model each.

Everything else stays in this process, as in a local build (`index_builder.build`): the corpus is
read once by the same reader, each chunk of `--chunk-size` passages is sent to the pool and its
vectors are committed by the same writer, in corpus order, before the next chunk is read. So the
index equals a local build row for row, memory holds one chunk, and a rerun after a failure
resumes after the last committed chunk (a local build resumes a Ray one, and back).

Plain Ray actors in a `ray.util.ActorPool`, not a Ray Data pipeline: a Dataset's actor pool lives
for one execution, so driving Ray Data chunk by chunk would load every model again for every
chunk. A killed actor is restarted and its unfinished batch retried (`max_restarts`,
`max_task_retries`); a batch's vectors are placed by its position, so nothing is lost or doubled.

Ray is imported here only, and this module only for `--ray`: a local build never loads it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from index_builder.build import BuildError
from models.encoder import BiEncoder, EncoderSpec

RESTARTS = 3  # per actor, and retries per batch: a worker that keeps dying stops the build (it resumes)
# Ray keeps an actor it cannot place (its resources held by other work, or a restart with no room) pending
# forever, without a word: past these the build stops saying so instead of waiting with no message.
START_TIMEOUT_S = 600.0  # for every worker to be placed and load its model
BATCH_TIMEOUT_S = 1800.0  # for some batch to finish, while batches are out
INSTALL_HINT = "pip install 'dense-search[ray]'"


def import_ray():
    """The `ray` module, or BuildError saying how to install it."""
    try:
        import ray
        from ray.util import ActorPool  # noqa: F401  (ray's own import check: a broken install fails here)
    except ImportError:
        raise BuildError(f"--ray needs Ray: {INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_cluster(address: str | None) -> Iterator[None]:
    """Connected to Ray for the block: the session this process already has, else `ray.init(address)`
    (None: RAY_ADDRESS, else a cluster running on this machine, else a new local one; "auto": the
    cluster `ray start` runs here; "HOST:PORT" or "ray://HOST:10001": that one), shut down after."""
    ray = import_ray()
    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address, logging_level=logging.WARNING, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise BuildError(f"cannot connect to Ray at {address or 'the default address'}: {_first_line(error)}") from None
    try:
        yield
    finally:
        ray.shutdown()


class EncoderWorker:
    """One `BiEncoder` in a Ray actor. `crash_once=(marker file, n)` is a test hook: the actor whose
    n-th batch finds no `marker` creates it and exits at once, as a killed worker would (so exactly one
    actor dies, once); unused otherwise."""

    def __init__(self, encoder_options: dict, crash_once: tuple[str, int] | None = None) -> None:
        self.encoder = BiEncoder(**encoder_options)
        self.crash_once = crash_once
        self.batches = 0

    def describe(self) -> dict:
        encoder = self.encoder
        return {"spec": encoder.spec.to_dict(), "source": encoder.source, "backend": encoder.backend,
                "export_sha256": encoder.export_sha256}

    def encode(self, position: int, passages: Sequence[str]) -> tuple[int, np.ndarray]:
        self.batches += 1
        if self.crash_once is not None and self.batches == self.crash_once[1]:
            try:
                os.close(os.open(self.crash_once[0], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os._exit(1)
            except FileExistsError:
                pass
        return position, self.encoder.encode_passages(passages)


class RayEncoder:
    """`build_index`'s encoder (a `PassageEncoder`) on `workers` Ray actors, each one `BiEncoder` made
    from `encoder_options` (BiEncoder's keyword arguments, less `device`) with `gpus_per_worker` GPUs,
    or on the CPU where that is 0. Defaults: 1 GPU each where the cluster has GPUs and `device` is not
    "cpu" ("cuda" insists on GPUs), else CPU actors; as many actors as the cluster has free now. Call
    `close()` (or use `with`) to end the actors. `crash_once` is a test hook (see EncoderWorker)."""

    def __init__(self, encoder_options: dict, *, workers: int | None = None, gpus_per_worker: float | None = None,
                 device: str = "auto", max_restarts: int = RESTARTS, crash_once: tuple[str, int] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, batch_timeout_s: float = BATCH_TIMEOUT_S) -> None:
        ray = import_ray()
        from ray.util import ActorPool

        self.batch_size = encoder_options.get("batch_size") or 64  # None: BiEncoder's own choice, per actor
        self.start_timeout_s, self.batch_timeout_s = start_timeout_s, batch_timeout_s
        resources, free = ray.cluster_resources(), ray.available_resources()
        gpus, cpus = resources.get("GPU", 0), resources.get("CPU", 0)
        if gpus_per_worker is None:  # an ONNX backend runs on the CPU only
            cpu_only = device == "cpu" or encoder_options.get("backend", "torch") != "torch"
            gpus_per_worker = 0.0 if cpu_only or not gpus else 1.0
        if device == "cpu" and gpus_per_worker:
            raise BuildError("--device cpu and --gpus-per-worker > 0 disagree")
        if device == "cuda" and not gpus_per_worker:
            raise BuildError(f"--device cuda: the Ray cluster has {gpus:g} GPUs and --gpus-per-worker is 0")
        if gpus_per_worker > gpus:
            raise BuildError(f"--gpus-per-worker {gpus_per_worker:g}: the Ray cluster has {gpus:g} GPUs")
        if workers is None:  # what is free: a Serve application or another job may hold the rest
            free_gpus, free_cpus = free.get("GPU", 0), free.get("CPU", 0)
            workers = min(int(free_gpus // gpus_per_worker), int(free_cpus)) if gpus_per_worker else int(free_cpus)
            if workers < 1:
                raise BuildError(f"the Ray cluster has no room for an encoder worker (1 CPU, {gpus_per_worker:g} GPUs) "
                                 f"now: {free_cpus:g} of {cpus:g} CPUs and {free_gpus:g} of {gpus:g} GPUs are free; "
                                 "pass --workers N to wait for them")
        # An actor asks for 1 CPU (tokenizing; its torch threads) and its GPUs; refuse a pool that
        # could never be placed, since its actors would wait forever.
        if workers > cpus or workers * gpus_per_worker > gpus:
            raise BuildError(f"--workers {workers} x (1 CPU, {gpus_per_worker:g} GPUs) is more than the Ray cluster "
                             f"has ({cpus:g} CPUs, {gpus:g} GPUs)")
        self.workers, self.gpus_per_worker = workers, gpus_per_worker
        actor_device = "cuda" if gpus_per_worker else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs
        actor_class = ray.remote(EncoderWorker).options(
            num_cpus=1, num_gpus=gpus_per_worker, max_restarts=max_restarts, max_task_retries=max_restarts)
        options = {**encoder_options, "device": actor_device}
        self._actors = [actor_class.remote(options, crash_once) for _ in range(workers)]
        try:
            described = self._get([actor.describe.remote() for actor in self._actors])
            first = described[0]
            for other in described[1:]:  # e.g. a different model folder at the same path on another node
                if other != first:
                    changed = sorted(k for k in first["spec"] if first["spec"][k] != other["spec"].get(k))
                    raise BuildError(f"Ray encoder workers disagree on {', '.join(changed) or 'the backend'}: "
                                     f"{first} != {other}")
        except BaseException:
            self.close()
            raise
        self.spec = EncoderSpec(**first["spec"])
        self.source, self.backend, self.export_sha256 = first["source"], first["backend"], first["export_sha256"]
        self._pool = ActorPool(self._actors)

    @property
    def dimension(self) -> int:
        return self.spec.dimension

    def encode_passages(self, passages: Sequence[str], progress: tqdm | None = None) -> np.ndarray:
        """(len(passages), dimension) float32 rows in the order given, encoded by the actors a batch at a time."""
        out = np.empty((len(passages), self.dimension), dtype=np.float32)
        # Longest first and by length, so each batch pads little (each actor sorts by tokens within it).
        order = sorted(range(len(passages)), key=lambda i: -len(passages[i]))
        batches = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        for number, batch in enumerate(batches):
            self._pool.submit(lambda actor, value: actor.encode.remote(*value), (number, [passages[i] for i in batch]))
        while self._pool.has_next():
            number, vectors = self._get_next()
            out[batches[number]] = vectors
            if progress is not None:
                progress.update(len(batches[number]))
        return out

    def _get_next(self) -> tuple[int, np.ndarray]:
        try:
            return self._pool.get_next_unordered(timeout=self.batch_timeout_s)
        except TimeoutError:
            raise BuildError(f"no batch finished in {self.batch_timeout_s:g} s (a restarted worker Ray cannot "
                             "place?); rerun to resume") from None
        except Exception as error:  # a worker past its restarts, or a batch that failed in the model
            raise BuildError(f"Ray encoder worker failed: {_first_line(error)}; rerun to resume") from None

    def _get(self, refs: list) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise BuildError(f"{len(refs)} Ray encoder workers did not all start within {self.start_timeout_s:g} s: "
                             f"the cluster has no room for them now (free: {_free(ray)}), or their model loads "
                             "slowly; pass fewer --workers") from None
        except Exception as error:  # e.g. the model cannot load on a node
            raise BuildError(f"Ray encoder worker failed to start: {_first_line(error)}") from None

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []

    def __enter__(self) -> RayEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _free(ray) -> str:
    free = ray.available_resources()
    return f"{free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs"


def _first_line(error: BaseException) -> str:
    """The innermost cause of a Ray error, on one line (Ray's own messages hold whole tracebacks)."""
    while getattr(error, "cause", None) is not None and error.cause is not error:
        error = error.cause
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1].strip() if lines else ''}"

