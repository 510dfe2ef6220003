"""What goes wrong with checkpoints, as exception types callers can tell apart."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit this run."""


class CheckpointLayoutError(CheckpointError):
    """The checkpoint was saved with another tensor/pipeline/virtual-pipeline layout."""


class CheckpointCorruptError(CheckpointError):
    """A file of the checkpoint differs from what its manifest recorded at save time."""
