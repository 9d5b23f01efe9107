"""The desktop app's widgets, one per module. They show state and forward user actions; logic lives in
app.controller and app.worker."""
