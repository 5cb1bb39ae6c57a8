from lab.sample.sampler import Sampler

__all__ = ["Sampler"]
