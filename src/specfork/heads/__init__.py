"""Trained draft heads: the head model (`model`) and the heads shipped with specfork
(`packaged`). Making their data and training them are tools (`specfork.tools.head_data`,
`specfork.tools.head_train`), above the engine they use."""
