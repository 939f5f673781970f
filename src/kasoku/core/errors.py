"""The base of every error kasoku raises on purpose: the CLI prints these as one clear line."""


class KasokuError(Exception):
    """An error with a message that says what is wrong and what to do."""


class NotADiffusersPipeline(KasokuError, ValueError):
    """A folder or object that is not a diffusers pipeline kasoku supports."""
