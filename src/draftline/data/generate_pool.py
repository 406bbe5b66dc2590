"""The target's local generation on several processes (``draftline regenerate --workers N``).

Each worker is a ``LocalGenerator`` in its own process: on its own GPU (``cuda:k``), or on CPU with its
share of the cores. It is for several GPUs: on two CPU cores, one process's two threads decoded the
demo's target as fast (an AMD EPYC) or faster (an Intel Xeon: 1.3x) than two processes of one thread
(docs/benchmarks/2026-12-demo-sizing.md).

``complete`` cuts its conversations into consecutive chunks of ``batch_size``, one per worker, and
returns the replies in their order: with groups of ``batch_size x workers`` the batches are the ones
one process makes from groups of ``batch_size``, so greedy replies match it. A worker that fails or
dies ends the call with an error naming it; ``close`` stops them all.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from draftline.cores import usable_cores
from draftline.data.generate import Reply
from draftline.errors import DraftlineError

_START_TIMEOUT_S = 600.0
"""How long a worker may take to import torch and load the target."""


def _serve(conn, target_dir: str, device: str, threads: int | None, options: dict) -> None:
    """A worker's life: load the target, then answer each list of conversations until told to stop."""
    try:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        from draftline.data.generate import LocalGenerator

        generator = LocalGenerator(target_dir, device=device, **options)
        conn.send(("ready", str(generator.device)))
        while (conversations := conn.recv()) is not None:
            conn.send(("replies", generator.complete(conversations)))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):  # a stop, or the parent is gone
        return
    except Exception as exc:  # told to the parent, which names this worker
        try:
            conn.send(("error", str(exc) if isinstance(exc, DraftlineError) else f"{type(exc).__name__}: {exc}"))
        except (BrokenPipeError, OSError):
            pass


def worker_devices(workers: int, device: str | None = None) -> tuple[list[str], int | None]:
    """Each worker's device and, on CPU, its threads: ``cuda:0..N-1`` where there are GPUs (at least
    ``workers`` of them), else the CPU with the usable cores shared out."""
    import torch

    if workers < 1:
        raise DraftlineError(f"--workers must be >= 1, got {workers}")
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        gpus = torch.cuda.device_count()
        if workers > gpus:
            raise DraftlineError(f"--workers {workers}: this machine has {gpus} GPU(s); one worker per GPU at most")
        return [f"cuda:{k}" for k in range(workers)], None
    return ["cpu"] * workers, max(1, usable_cores() // workers)


class GeneratorPool:
    """``LocalGenerator`` on ``workers`` processes, behind the same ``complete``."""

    def __init__(self, target_dir: str | Path, workers: int, *, batch_size: int = 8, device: str | None = None,
                 **options):
        devices, threads = worker_devices(workers, device)
        self.batch_size = batch_size
        context = multiprocessing.get_context("spawn")  # torch and threads do not survive a fork
        self._workers = []
        for k, dev in enumerate(devices):
            parent, child = context.Pipe()
            own = {**options, "batch_size": batch_size, "seed": options.get("seed", 0) + k}  # sampling: a stream each
            process = context.Process(target=_serve, args=(child, str(target_dir), dev, threads, own),
                                      name=f"regenerate-worker-{k}", daemon=True)
            process.start()
            child.close()
            self._workers.append((parent, process))
        try:
            started = [self._receive(k, "ready", _START_TIMEOUT_S) for k in range(workers)]
        except BaseException:
            self.close()
            raise
        self.device = started[0] if workers == 1 else f"{workers} processes on {', '.join(sorted(set(started)))}"
        if threads is not None:
            self.device += f" ({threads} thread(s) each)"

    def _name(self, k: int) -> str:
        return f"regenerate worker {k} (pid {self._workers[k][1].pid})"

    def _died(self, k: int) -> DraftlineError:
        process = self._workers[k][1]
        process.join(5)
        return DraftlineError(f"{self._name(k)} died (exit code {process.exitcode}); the records of its group are "
                              "not written: rerun the same command to continue")

    def _send(self, k: int, message) -> None:
        try:
            self._workers[k][0].send(message)
        except (BrokenPipeError, OSError):
            raise self._died(k) from None

    def _receive(self, k: int, kind: str, timeout: float | None = None):
        conn = self._workers[k][0]
        if timeout is not None and not conn.poll(timeout):
            raise DraftlineError(f"{self._name(k)} did not start within {timeout:.0f} s")
        try:
            got, value = conn.recv()
        except (EOFError, OSError):
            raise self._died(k) from None
        if got == "error":
            raise DraftlineError(f"{self._name(k)}: {value}")
        assert got == kind, (got, kind)
        return value

    def complete(self, conversations: list[list[dict]]) -> list[Reply]:
        chunks = [conversations[i : i + self.batch_size] for i in range(0, len(conversations), self.batch_size)]
        replies: list[Reply] = []
        for first in range(0, len(chunks), len(self._workers)):  # one round: a chunk per worker
            round_ = chunks[first : first + len(self._workers)]
            for k, chunk in enumerate(round_):
                self._send(k, chunk)
            for k in range(len(round_)):
                replies.extend(self._receive(k, "replies"))
        return replies

    def close(self) -> None:
        for conn, process in self._workers:
            try:
                if process.is_alive():
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for conn, process in self._workers:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)
            conn.close()
        self._workers = []
