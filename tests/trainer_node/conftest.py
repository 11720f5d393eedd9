from .daemon import tiny_job, trainers  # noqa: F401  (fixtures)
