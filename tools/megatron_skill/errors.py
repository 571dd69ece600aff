"""One error type for every tool: what went wrong, where in the request, and how to fix it.

Each code has its own process exit status, so a caller can branch without parsing text.
"""
from __future__ import annotations

EXIT_CODES = {
    "bad_request": 2,     # the request does not match its schema
    "bad_model": 2,       # a model given by fields or config.json is malformed
    "not_found": 3,       # an unknown model, GPU, file or run
    "infeasible": 4,      # valid, but no layout or configuration can satisfy it
    "environment": 5,     # something the tool needs is not installed or not present
    "conflict": 6,        # the same job is already running or done
    "invalid_script": 7,  # validate found errors in a launch script or request
    "runtime": 8,         # the work itself failed (training crashed, ...)
    "internal": 9,        # a bug of the skill's own (never the request's fault): please report it
    "refused": 10,        # an event that is not to be trusted: unsigned, forged or stale
}


class ToolError(Exception):
    """An error a tool reports as JSON instead of a traceback."""

    def __init__(self, code: str, message: str, where: str | None = None, fix: str | None = None,
                 details: dict | None = None):
        assert code in EXIT_CODES, code
        super().__init__(message)
        self.code, self.message, self.where, self.fix, self.details = code, message, where, fix, details

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.code]

    def to_json(self) -> dict:
        out = {"code": self.code, "message": self.message}
        if self.where:
            out["where"] = self.where
        if self.fix:
            out["fix"] = self.fix
        if self.details:
            out["details"] = self.details
        return out
