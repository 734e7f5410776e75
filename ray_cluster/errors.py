"""One exception type for cluster problems a user can fix; the CLI prints it as one line and exits 2."""


class ClusterError(RuntimeError):
    """A cluster, placement or job problem the user can fix.

    The message names the input (slice, address, job id, file) and says what to do next.
    """
