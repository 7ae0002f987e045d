"""The engine: requests (`request`), one round of any strategy (`round`), the scheduler that
runs rounds of one or many requests (`batch`), what a request does around its rounds
(`lifecycle`), and the public `generator.Generator` on top."""
