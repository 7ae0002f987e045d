"""Strategies: a drafter and a draft-length policy plugged into the engine's one loop.

"ar" is plain decoding (no drafter); "speculative" drafts chains and verifies them losslessly
(see `specfork.verify`); "dspark" re-chooses the chain's length every round; "spork" drafts
trees. `registry` holds what differs per strategy and drafter kind, `build` builds what a
`SpecConfig` asks for (`build.build_strategy`), `bound` sizes a round's draft.
"""
