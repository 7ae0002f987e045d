"""What strategies and drafters exist, as plain data (`kinds`), and the drafter mini-language
(`sources`): below `config`, so that `SpecConfig` validates against them; the builders that
go with each entry are in `specfork.strategies.registry`."""
