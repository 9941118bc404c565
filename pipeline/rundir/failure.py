"""OUT/shards/shard_N.failed.json: why shard N's last attempt did not finish, one record whoever writes it
(the worker itself, the local parent that saw it die, the Ray driver whose task failed). `status`, `rerun`'s
reports and report.html read it; any attempt that finishes the shard removes it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from ..exits import EXIT_INTERRUPTED, explain_exit


@dataclass
class FailureRecord:
    exit_code: int | None        # the worker's exit code (negative: killed by that signal); None: no process
    explanation: str             # the exit code in words (exits.explain_exit)
    reason: str = ""             # the worker's own error message, or why run_shards stopped it
    interrupted: bool = False    # stopped at a final checkpoint (a stop signal), not failed
    log: str = ""                # the shard's worker log
    log_tail: list[str] = field(default_factory=list)   # its last lines when the record was written
    rerun_repeats: bool = False  # it refused the run's settings (errors.SettingsRefused): a rerun stops the same way

    @classmethod
    def of_exit(cls, code: int | None, reason: str = "", killed_for: str = "", interrupted: bool | None = None,
                log: str = "", log_tail: list[str] | None = None, explanation: str = "",
                rerun_repeats: bool = False) -> "FailureRecord":
        """The record of an exit code: its words, and `interrupted` from the code unless told."""
        return cls(exit_code=code, explanation=explanation or explain_exit(code, killed_for), reason=reason,
                   interrupted=code == EXIT_INTERRUPTED if interrupted is None else interrupted,
                   log=log, log_tail=list(log_tail or []), rerun_repeats=rerun_repeats)

    def summary(self) -> str:
        """`killed by SIGKILL (...) - why`, the reason left out where the explanation already says it."""
        if not self.reason or self.reason in self.explanation:
            return self.explanation
        return f"{self.explanation} - {self.reason}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "FailureRecord":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a failure record is a JSON object")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
