"""Operations: observers, systemd notify, metrics, timelines, logs."""
