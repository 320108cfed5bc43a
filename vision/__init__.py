"""vision recipes (see README)."""

__all__: list[str] = []
