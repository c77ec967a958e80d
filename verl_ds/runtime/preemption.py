"""Preemption: SIGTERM / SIGUSR1 (Slurm's), SIGINT and SIGHUP set a flag; at the next step boundary every rank
agrees, the trainer checkpoints and exits 75 (EX_TEMPFAIL), which the sbatch scripts requeue on. SIGINT and SIGHUP
inherited as ignored (``nohup``, a background job) stay ignored. Details: docs/reliability.md, "Preemption"."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

from verl_ds import dist as vdist

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL, "try again later" (sysexits.h); slurm/train.sbatch requeues on it


class Preempted(SystemExit):
    """Raised by the trainer after the preemption checkpoint; the process exits with PREEMPTED_EXIT_CODE."""

    def __init__(self, signal_name: str, step: int, checkpoint: Optional[str]):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        self.message = (f"verl_ds: {signal_name} received: stopped after step {step}, {saved}; exiting with "
                        f"{PREEMPTED_EXIT_CODE} (the Slurm scripts requeue a preempted job on it, up to MAX_REQUEUES; "
                        f"a restart with trainer.resume=auto continues)")


class PreemptionHandler:
    """Turns SIGTERM / SIGUSR1 / SIGINT / SIGHUP into a stop request honoured at a step boundary."""

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")
    RESPECT_IGNORED = ("SIGINT", "SIGHUP")  # nohup's promise, and a shell's for its background jobs

    def __init__(self):
        self.received: Optional[str] = None
        self._previous: dict = {}

    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1/SIGINT/SIGHUP will not stop training cleanly")
            return self
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            if name in self.RESPECT_IGNORED and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # no I/O here: the main thread may be inside a write to the same stream
        if self.received is None:
            self.received = signal.Signals(signum).name

    def stop_requested(self) -> Optional[str]:
        """Collective: the signal's name on every rank when any rank got one, else None."""
        if not vdist.any_rank(self.received is not None):
            return None
        return self.received or "a preemption signal (on another rank)"

