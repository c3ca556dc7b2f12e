"""The failures every entry point ends the same way: bad input (exit 2, before any rank works) and a peer that
stopped answering (exit 1, within the timeout). Torch-free, so the CLIs can catch them without importing torch."""


class InputError(ValueError):
    """Bad user input, reported as one line before any rank starts working."""


class LaunchError(RuntimeError):
    """The ranks could not be started as asked (a launcher missing, world sizes that disagree)."""


class PeerTimeout(RuntimeError):
    """A rank waited longer than allowed for another: one line, naming both and what was awaited."""


class ProfileError(ValueError):
    """A hardware profile that is missing, malformed or lacks what a run needs."""
