"""Model definitions on pagedray parallel layers."""
