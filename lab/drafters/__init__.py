"""Trained drafters that read the target's hidden states: EAGLE-style (one layer, feature space, a
chain) and DFlash (block diffusion with KV injection). Modules, checkpoints and target fingerprints."""

from lab.drafters.checkpoint import load_drafter, save_drafter, target_fingerprint
from lab.drafters.dflash import DFlashConfig, DFlashDrafter
from lab.drafters.eagle import EagleConfig, EagleDrafter

__all__ = ["DFlashConfig", "DFlashDrafter", "EagleConfig", "EagleDrafter", "load_drafter", "save_drafter",
           "target_fingerprint"]
