from core.checkpoint.retention import kept_at_once, retained

__all__ = ["kept_at_once", "retained"]
