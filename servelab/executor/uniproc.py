"""``"uniproc"``: the model runner in the caller's process (the default for one rank).

The pipeline builds its :class:`~servelab.pipeline.runner.ModelRunner` and KV cache as it
always has; this executor only wraps that runner so that every pipeline has an executor
(``pipe.executor``) with the same calls and ``shutdown``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from servelab.executor.interface import Executor, ExecutorDeadError
from servelab.scheduling.output import ModelRunnerOutput, SchedulerOutput

__all__ = ["UniprocExecutor"]


class UniprocExecutor(Executor):
    """The in-process runner behind the executor calls (see the module docstring)."""

    name: ClassVar[str] = "uniproc"
    in_process: ClassVar[bool] = True
    supports_structured_outputs: ClassVar[bool] = True

    def __init__(self, runner: Any = None) -> None:
        super().__init__()
        self.runner = runner
        self._closed = False

    def start(self, spec: Any) -> None:
        """Bind the pipeline's runner (``spec`` is the runner itself here)."""
        self.runner = spec

    def _live(self) -> Any:
        if self._closed or self.runner is None:
            raise ExecutorDeadError("the uniproc executor is shut down" if self._closed
                                    else "the uniproc executor has no runner (start() was not called)")
        return self.runner

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        runner = self._live()
        out = runner.execute(so)
        self.last_verification = runner.last_verification
        return out

    def rollback(self, so: SchedulerOutput) -> None:
        if self.runner is not None:
            self.runner.rollback(so)

    def remove_request(self, req_id: str) -> None:
        if self.runner is not None:
            self.runner.remove_request(req_id)

    @property
    def prompt_logprobs(self) -> Any:  # type: ignore[override]
        return self._live().prompt_logprobs

    @prompt_logprobs.setter
    def prompt_logprobs(self, value: Any) -> None:
        pass  # the runner's own collector is the one read

    def shutdown(self) -> None:
        self._closed = True
