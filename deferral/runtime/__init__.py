"""What every process of deferral runs on, whatever it does: settings (``config``), process
plumbing (``process``), metrics, encryption (``crypto``), tagged-JSON values (``serialization``),
masking secrets and control characters, transient-fault classification, Redis URLs."""
