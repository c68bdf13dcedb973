"""Op placement rules: one registry, one file per op family."""
