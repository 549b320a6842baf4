"""Delta Lake targets: tables at PATH/<schema>/<table>, Sluicegate's state and consistent-read log under
PATH/_sluicegate/ (see README, "Delta Lake target")."""
