"""Trained draft heads: the head model (`model`), the data the target makes for it (`data`),
its training (`train`), and the heads shipped with specfork (`packaged`)."""
