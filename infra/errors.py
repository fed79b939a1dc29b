"""
infra/errors.py: the one exception type a run stops on.

Every file of infra/ raises its own subclass of `RunError` (OptionError, CheckpointError,
TaskError, LaunchError, ArchitectureError, LoraError, EngineError) with a message of one line
that says what to change. train.py catches `RunError` in one place, its `__main__`: it prints
`train.py: <label>: <message>` on stderr and exits with the error's `exit_code`, once per node
when every rank raised the same error (`agreed`, set by launch.agree).

    exit 2   a refusal: a bad option, a checkpoint that does not verify, missing task data,
             a layout the nodes cannot hold; nothing was started or changed
    exit 1   an engine that died, stayed silent or failed a command, past what healing allows
"""


class RunError(Exception):
    """A run that stops with one line. `exit_code`: the process's status; `label`: the word
    after "train.py:"; `agreed`: every rank raised it (launch.agree), so one rank per node
    prints it."""

    exit_code = 2
    label = "error"
    agreed = False

    def line(self) -> str:
        """The one line train.py prints for it: `train.py: error: ...`."""
        return f"train.py: {self.label}: {self}"
