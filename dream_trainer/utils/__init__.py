"""Small helpers used by the trainer loop."""
