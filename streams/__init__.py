"""Faust agents: detection, attribution and policy. Imports only schemas/."""
