"""Optional integrations with other libraries; each module imports its library only when used."""
