"""Child processes of the tests: waited for within a bound, and never left running."""

import subprocess


def finish(proc: subprocess.Popen, timeout: float):
    """``proc``'s (stdout, stderr) once it exits within ``timeout`` seconds; killed and reaped if it
    does not (the timeout then fails the test), so no child outlives the test."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
