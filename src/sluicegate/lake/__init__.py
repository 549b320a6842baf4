"""The Delta Lake target (issue 27): tables under delta:PATH, state and the points log under PATH/_sluicegate/."""
