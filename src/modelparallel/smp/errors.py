"""The error of an SMP call made before ``init()``."""


class NotInitializedError(RuntimeError):
    def __init__(self, what: str = "this"):
        super().__init__(f"modelparallel is not initialized: call mp.init(config) before "
                         f"using {what}")
