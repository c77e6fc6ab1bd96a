"""MLflow: tracking runs, model logging, registration and aliases."""
