"""sdiree.specs: per-target flags, arch presets and tuning specs, as data (targets.json)."""
