"""Getting samples to the step: the loader of index-addressed data sources (:mod:`.indexed`,
whose base class and helpers plugin authors import from :mod:`core.api`) and the prefetching
wrapper that fetches the next step's micro-batches while this one computes (:mod:`.prefetch`).
"""
