"""The pytest side of the plugin: fixtures, hooks' helpers, what a test session learns about its clusters."""
