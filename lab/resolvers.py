"""OmegaConf resolvers our configs use, registered once on import (lab.run, lab.train and the serving
CLIs import this before Hydra composes anything).

    num_prompts: ${max:4,${concurrency}}     # enough prompts to fill every concurrency of a sweep
"""

from __future__ import annotations

from omegaconf import OmegaConf

if not OmegaConf.has_resolver("max"):
    OmegaConf.register_new_resolver("max", lambda *values: max(values))
