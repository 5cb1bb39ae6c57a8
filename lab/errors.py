"""User-facing errors: one clear message naming the problem and the fix, never a traceback wall."""


class LabError(Exception):
    """A problem with the user's input or environment. `lab.run` prints it and exits with code 2."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}\n  fix: {fix}" if fix else problem)

    @property
    def one_line(self) -> str:
        """Problem and fix on one line (an HTTP error body)."""
        return f"{self.problem}; fix: {self.fix}" if self.fix else self.problem
