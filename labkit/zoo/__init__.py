"""The models and data every strategy trains: configs (no torch), models, synthetic datasets."""
