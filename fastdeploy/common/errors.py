"""Errors that cross module boundaries."""


class ParameterError(ValueError):
    """A request parameter is out of range; `param` names it for the 400 response."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
